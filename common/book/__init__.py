"""The book: the chapters' helpers (chapter.py) and figures (figures/), making and checking the chapters (make.py,
`python -m common.book`), and the tools' captures the chapters show (capture_*.py).
"""

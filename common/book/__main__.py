"""python -m common.book: make the chapters (common/book/make.py)."""

import sys

from common.book.make import main

sys.exit(main())

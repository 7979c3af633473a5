"""Level 2: backpropagation theory. The formulas live in `backprop.py`, the derivation in `chapter.ipynb`, the chain
rule automated (a scalar autograd engine) in `autograd.py`."""

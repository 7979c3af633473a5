"""The harness: train every level on the same data from the same weights, verify each against level 1, time it.

data.py (MNIST, the training set), compare.py (the main job), verify.py and verify_lenet.py (what "verified" means:
lockstep, the free run, per layer), bench.py (make bench), serving.py (make infer), peers.py (the peers' speed
checked), the level 7 measurements (level7_*.py) and results.py (their files).
"""

"""The classroom: the student edition and its tasks (lab.py, lab_native.py, sgemm.py), a student's grade (grade.py)
and a class's (gradebook.py), whose students' code runs only in the sandbox (sandbox.py, worker.py). LABS.md says how.
"""

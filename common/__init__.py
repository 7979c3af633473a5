"""Shared by every level: the list of levels, data, initial weights, input checks, the native binding and the harness."""

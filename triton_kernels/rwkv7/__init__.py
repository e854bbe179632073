"""Triton twins of the RWKV-7 WKV recurrence, one file per algorithm: recurrent.py (sequential over T)."""

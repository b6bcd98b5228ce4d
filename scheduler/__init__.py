"""Plain-Python continuous-batching scheduler: requests, sampling params, the policy.

No torch, no FastAPI, no prometheus_client here (a test checks it).
"""

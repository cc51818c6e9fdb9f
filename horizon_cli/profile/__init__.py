"""`horizon profile`: bandwidth, timings, the overlap achieved, a trace and a timeline plot."""

from .run import run_profile

__all__ = ["run_profile"]

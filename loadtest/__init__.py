"""Load generation for OpenAI-compatible servers: locust users and shapes (locustfile.py,
shapes.py: only locust imports them), the workload generator, the `meterserve loadtest` runner
and its report, and the serving benchmark. See docs/loadtest.md."""

"""The meter's export: `prometheus_export.py` (ServerMetrics, the only place readings become
Prometheus series), `metric_definitions.py` (families, labels, buckets), `tenant_metrics.py`
(per-tenant bills), `live_window.py` (the console's recent-steps window), `energy_collector.py`
(RAPL joules). Costs are computed in engine/meter; this package exports them."""

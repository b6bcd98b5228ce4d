"""TenantMetrics: the per-tenant counters (cost and revenue per customer), for ServerMetrics.

Labels stay bounded: `tenant` is one of the values the TenantDirectory labels with (the
configured names up to a cap, "default", "other"), and the series of every labelled tenant
exist from start-up so rate() sees a tenant's first request. ServerMetrics holds the lock.

Every series with a `tenant` label lives here, in a registry of its own
(ServerMetrics.tenant_registry): /metrics renders it only for scrapes allowed to see every
tenant's bill (server/routes/metrics.py).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from engine.meter.billing import Bill

PREFIX = "meterserve_tenant_"


class TenantMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        tenants: tuple[str, ...],
        finished_reasons: tuple[str, ...],
    ) -> None:
        self.model_name = model_name

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, ("model", "tenant", *labels), registry=registry)

        self.prompt_tokens = counter("prompt_tokens", "Billed prompt tokens by tenant.")
        self.cached_tokens = counter(
            "cached_prompt_tokens", "Billed prompt tokens from the prefix cache, by tenant."
        )
        self.generation_tokens = counter("generation_tokens", "Delivered output tokens by tenant.")
        self.requests = counter(
            "requests",
            "Finished engine requests by tenant and finish_reason.",
            ("finished_reason",),
        )
        self.cost = counter("cost_dollars", "Usage-basis hardware cost of the tenant's requests.")
        self.revenue = counter("revenue_dollars", "What the tenant's requests are charged.")
        for tenant in tenants:
            for metric in (
                self.prompt_tokens,
                self.cached_tokens,
                self.generation_tokens,
                self.cost,
                self.revenue,
            ):
                metric.labels(model=model_name, tenant=tenant)
            for reason in finished_reasons:
                self.requests.labels(model=model_name, tenant=tenant, finished_reason=reason)

    def observe_delivered(self, tenant: str, num_tokens: int) -> None:
        self.generation_tokens.labels(model=self.model_name, tenant=tenant).inc(num_tokens)

    def observe_settlement(self, tenant: str, bill: Bill, finish_reasons: list[str]) -> None:
        m = self.model_name
        self.prompt_tokens.labels(model=m, tenant=tenant).inc(bill.prompt_tokens)
        self.cached_tokens.labels(model=m, tenant=tenant).inc(bill.cached_tokens)
        self.cost.labels(model=m, tenant=tenant).inc(bill.cost_usd)
        self.revenue.labels(model=m, tenant=tenant).inc(bill.revenue_usd)
        for reason in finish_reasons:
            self.requests.labels(model=m, tenant=tenant, finished_reason=reason).inc()

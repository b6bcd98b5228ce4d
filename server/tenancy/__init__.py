"""Who is asking: `auth.py` (API keys, the tenant header), `tenants.py` (the keys file, tenants
and their price plans), `cache_salt.py` (a tenant's prefix-cache isolation)."""

"""Who is asking: `auth.py` (API keys, the tenant header), `tenants.py` (tenants, their price
plans and keys), `keys_file.py` (the --api-keys-file format), `cache_salt.py` (a tenant's
prefix-cache isolation)."""

"""Makes tests/ importable for shared helpers (server_process) from every test folder."""

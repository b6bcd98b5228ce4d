"""meterserve package."""

"""Integrations of flash_cute with frameworks (optional dependencies, imported on demand)."""

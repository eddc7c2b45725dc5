"""Adapters that run GRAPE inside a trainer; each folder one trainer, none imported by the core."""

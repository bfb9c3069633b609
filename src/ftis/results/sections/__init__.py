"""The systems' sections of a run's report.md (`ftis report`), registered by name as each
algorithm's `report` (ftis.plugins.AlgorithmSpec)."""

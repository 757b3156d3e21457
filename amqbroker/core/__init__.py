"""The broker core: addresses, queues, consumers, group dispatch and settlement.

Pure Python, synchronous and deterministic. Time is injected. Nothing here imports
proton, trio, click or the OpenTelemetry SDK (enforced by import-linter).
"""

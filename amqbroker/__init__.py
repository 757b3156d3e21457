"""amqbroker: an AMQP 1.0 message broker with first-class message grouping."""

__version__ = "0.1.0"

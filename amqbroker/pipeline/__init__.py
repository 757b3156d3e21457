"""The data pipeline: the delivery log's file format, the PySpark audit and the Spark
connector (extra ``amqbroker[spark]``).

Keep this ``__init__`` free of imports: the broker's store imports
`amqbroker.pipeline.delivery_log_format`, which must not pull in pyspark.
"""

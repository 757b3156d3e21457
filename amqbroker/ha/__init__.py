"""Primary/backup replication of a node's store (issue 23): the stream format
(`stream`), the primary's side (`primary`) and the backup's mirror (`mirror`)."""

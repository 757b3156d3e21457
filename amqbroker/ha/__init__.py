"""High availability (issue 23): a backup per node id. The stream format (`stream`),
the primary's side (`primary`), the backup's mirror (`mirror`), the ZooKeeper lease that
picks the live member (`lease`) and a member's role (`roles`)."""

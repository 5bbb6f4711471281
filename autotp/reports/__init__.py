"""What a plan costs each rank for a batch: parameters, communication, memory and time, for tensor, pipeline and
context parallelism, read by ``parallelize``'s checks, the layout search and the command line."""

"""`splitserve bench`: load generators and benchmarks that print figures as ratios to a limit or a peer."""

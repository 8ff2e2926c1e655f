"""The runtime: the driver's control loop per source (mint -> read -> commit
-> resume -> acknowledge), the data plane run in Spark tasks, health states,
the Spark session and the progress log."""

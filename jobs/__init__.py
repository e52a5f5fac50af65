"""Job records, the job state machine and its services, the jobs API."""

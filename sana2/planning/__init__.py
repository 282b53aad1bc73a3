"""The memory plan: a dry run of the parallelisation, a measured activation model, a walk through one step."""

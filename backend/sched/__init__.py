"""Scheduling: the scheduler, the waiting queue, policies, preemption, fair share."""

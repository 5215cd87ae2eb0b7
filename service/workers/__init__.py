"""Workers: the scheduler that feeds free slots, the device slots, and the executors that launch jobs."""

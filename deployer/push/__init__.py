"""Push mode: the controller reads each device's facts, plans, and rolls releases out over a transport."""

"""What passes moved and cost: pass reports, memory samplers, compile time."""

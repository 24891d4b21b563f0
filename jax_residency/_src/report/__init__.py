"""What passes moved and cost: the metric types, pass reports, memory samplers,
compile time.
"""

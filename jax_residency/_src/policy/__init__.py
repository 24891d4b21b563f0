"""What a user asks for: byte sizes, load options, the policy types, and the errors
every stage raises.
"""

"""What a role shows about itself: Prometheus metrics and their endpoint, and log set-up.
"""

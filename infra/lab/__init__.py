"""Separate hosts on one machine for tests: Linux network namespaces, veth pairs and a bridge.
"""

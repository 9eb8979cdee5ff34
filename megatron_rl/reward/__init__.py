"""reward"""

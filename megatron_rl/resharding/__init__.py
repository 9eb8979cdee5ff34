"""resharding"""

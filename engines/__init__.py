"""Engines behind one contract (base.Engine), looked up by name through registry."""

"""Thin HTTP routers: parse, authorize, hand over to the runner, render."""

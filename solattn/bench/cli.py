"""Placeholder replaced below."""
def add_arguments(p):
    pass
def run(args):
    raise NotImplementedError

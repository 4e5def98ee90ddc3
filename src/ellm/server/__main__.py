"""`python -m ellm.server MODEL [options]`: the same as `ellm serve`."""
import argparse
import sys

from .cli import add_arguments, main

parser = argparse.ArgumentParser(prog="python -m ellm.server", description="OpenAI-compatible server")
add_arguments(parser)
sys.exit(main(parser.parse_args()))

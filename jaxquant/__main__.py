"""``python -m jaxquant``: the demo a newcomer runs first."""

from jaxquant import _demo

if __name__ == "__main__":
  _demo.main()

from loraplex.triton.adapters_model import TritonPythonModel  # noqa: F401

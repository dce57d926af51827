from loraplex.triton.generate_model import TritonPythonModel  # noqa: F401

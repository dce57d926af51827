"""The slice of Triton's pb_utils the responder uses, for tests of it without a server: tensors by name."""

FINAL = 1


class FakePb:
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL

    class Tensor:
        def __init__(self, name, array):
            self.name, self.array = name, array

    class InferenceResponse:
        def __init__(self, output_tensors, error=None):
            self.tensors = {t.name: t.array for t in output_tensors}
            self.error = error

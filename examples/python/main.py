"""The smallest complete libpipe program in Python: load a TorchScript model, cut it into two
stages before blocks.2, run inputs from a safetensors file through the pipeline with 4
micro-batches, and compare the result with the reference output the model generator wrote.

    python main.py MODEL.pt INPUTS.safetensors REFERENCE.safetensors
"""

import sys

import numpy as np

import libpipe


def main(model_path, inputs_path, reference_path):
    inputs = libpipe.load_safetensors(inputs_path)
    reference = libpipe.load_safetensors(reference_path)["output"]

    with libpipe.Model.load(model_path) as model:
        with model.split(split_at=["blocks.2:begin"]) as plan:
            # Adaptive micro-batching (the default) cuts a call that finds the pipeline empty,
            # as this one does, into all 4 micro-batches; microbatching="fixed" would too.
            with plan.session(microbatches=4) as session:
                # Forward's arguments by name, looked up in the input file.
                args = {name: inputs[name] for name in model.input_names}
                output = session.run(**args)["output"]
                microbatches = session.stats()[0]["microbatches"]  # what the call was cut into

    if output.shape != reference.shape:
        print(f"output shape {output.shape} DIFFERS from PyTorch's {reference.shape}")
        return 1
    max_diff = float(np.max(np.abs(output.astype(np.float64) - reference))) if output.size else 0.0
    print(
        f"libpipe {libpipe.version()}: {plan.num_stages} stages, {microbatches} micro-batches, {output.size} values, "
        f"max |diff| vs PyTorch = {max_diff:.3g}"
    )
    ok = max_diff <= 1e-4
    print("output matches PyTorch" if ok else "output DIFFERS from PyTorch")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(f"usage: {sys.argv[0]} MODEL.pt INPUTS.safetensors REFERENCE.safetensors")
    try:
        sys.exit(main(*sys.argv[1:]))
    except libpipe.Error as e:
        sys.exit(f"{sys.argv[0]}: {e}")

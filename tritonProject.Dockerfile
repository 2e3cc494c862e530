# NVIDIA's PyTorch container ships PyTorch, Triton and Transformer Engine built together.
# 25.12: PyTorch 2.10.0a0+b4e4ee81d3 on CUDA 13.1.0 (NVIDIA's release notes); it is the oldest
# torch/Triton pair this repository supports (README, "Quick start").
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.12-py3
FROM ${BASE_IMAGE}

# The test tools requirements.txt lists for local runs; the container's pip constraint file
# keeps the packages it ships at their versions.
RUN python -m pip install --no-cache-dir pytest pytest-xdist hypothesis transformers matplotlib pandas

# The build log then records what the image runs the tests with.
RUN python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" && \
    python -c "import transformer_engine as te; print('transformer_engine', te.__version__)"

WORKDIR /workspace/triton-rotary
COPY . .
CMD ["bash"]

# NVIDIA's PyTorch container ships PyTorch, Triton and Transformer Engine built together.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE_IMAGE}

# pytest and matplotlib are in the base image; listed so the image stays complete if not.
RUN python -m pip install --no-cache-dir pytest matplotlib

WORKDIR /workspace/triton-rotary
COPY . .
CMD ["bash"]

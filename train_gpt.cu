// Placeholder-free platform check until the trainer lands: reports the device.
#include "kernels/common.cuh"
int main() {
    cudaDeviceProp p;
    CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
    std::printf("device: %s, %d SMs\n", p.name, p.multiProcessorCount);
    return 0;
}

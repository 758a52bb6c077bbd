// train_gpt.cu without its main, for the test programs that reach into the trainer. Included once:
// those programs are also compiled together as one (cmake/trainer_tests.cmake).
#pragma once
#define TRAIN_GPT_NO_MAIN
#include "../train_gpt.cu"

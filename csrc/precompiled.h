// The torch headers most translation units include, compiled once per build
// into a GCC precompiled header (setup.py, [Note: the precompiled header])
// and included first in every source. Only what is slow to parse and used
// widely belongs here; each source still includes what it uses.
#pragma once

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/custom_class.h>
#include <torch/library.h>

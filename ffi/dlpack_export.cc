// export_view: wraps a raw device (or host) pointer as a DLPack-capable nanobind ndarray, so
// jax.dlpack.from_dlpack imports arena memory zero-copy. The `owner` Python object is held by
// the ndarray's handle and released only when the last consumer (XLA's buffer, through the
// DLPack capsule deleter) lets go: the arena's live-view counter hangs off that release.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <vector>

namespace nb = nanobind;

namespace {

nb::dlpack::dtype DtypeOf(const std::string& name) {
  using nb::dlpack::dtype_code;
  if (name == "bfloat16") return {static_cast<uint8_t>(dtype_code::Bfloat), 16, 1};
  if (name == "float16") return {static_cast<uint8_t>(dtype_code::Float), 16, 1};
  if (name == "float32") return {static_cast<uint8_t>(dtype_code::Float), 32, 1};
  if (name == "int32") return {static_cast<uint8_t>(dtype_code::Int), 32, 1};
  if (name == "uint32") return {static_cast<uint8_t>(dtype_code::UInt), 32, 1};
  if (name == "uint8") return {static_cast<uint8_t>(dtype_code::UInt), 8, 1};
  throw nb::value_error(
      ("dtype: expected bfloat16, float16, float32, int32, uint32 or uint8, got " + name).c_str());
}

int DeviceTypeOf(const std::string& name) {
  if (name == "cuda") return nb::device::cuda::value;
  if (name == "cpu") return nb::device::cpu::value;
  throw nb::value_error(("device_type: expected 'cuda' or 'cpu', got " + name).c_str());
}

// XLA requires >= 64-byte aligned buffers on CPU; the arena promises 256 everywhere.
constexpr uintptr_t kMinAlign = 256;

}  // namespace

void RegisterDlpack(nb::module_& m) {
  m.def(
      "export_view",
      [](uintptr_t ptr, const std::vector<int64_t>& shape, const std::string& dtype,
         const std::string& device_type, int device_id, nb::object owner) {
        if (ptr == 0 || ptr % kMinAlign != 0) {
          throw nb::value_error(
              ("ptr: expected a non-null 256-byte aligned address, got " + std::to_string(ptr))
                  .c_str());
        }
        std::vector<size_t> dims;
        for (int64_t d : shape) {
          if (d < 0) throw nb::value_error("shape: expected non-negative extents");
          dims.push_back(static_cast<size_t>(d));
        }
        // Row-major, strides implied; `owner` is incref'd by the ndarray handle. array_api
        // returns nanobind's ndarray object (__dlpack__, __dlpack_device__), not a bare capsule.
        return nb::ndarray<nb::array_api>(reinterpret_cast<void*>(ptr), dims.size(), dims.data(),
                                          owner, nullptr, DtypeOf(dtype), DeviceTypeOf(device_type),
                                          device_id);
      },
      nb::arg("ptr"), nb::arg("shape"), nb::arg("dtype"), nb::arg("device_type"),
      nb::arg("device_id"), nb::arg("owner"),
      "A DLPack-capable view [shape] of `ptr`; `owner` lives until the last consumer releases "
      "it.");
}

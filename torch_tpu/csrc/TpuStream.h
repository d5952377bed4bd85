#pragma once
// Streams and events. A stream is an ordered queue of host tasks. Stream 0 of
// every device is the default stream: TensorCore ops run synchronously on the
// calling thread, so it never has pending work. Every other stream owns a
// worker thread (started on first use) that runs submitted tasks in order;
// other packages (the SparseCore executor) submit their work there, and
// device synchronization waits for all of them.

#include <c10/core/Stream.h>

#include <cstdint>
#include <functional>

namespace torch_tpu {

constexpr c10::StreamId kDefaultStreamId = 0;

c10::Stream default_stream(c10::DeviceIndex device);
c10::Stream new_stream(c10::DeviceIndex device);
c10::Stream current_stream(c10::DeviceIndex device);
// Makes s current for its device on this thread; returns the previous one.
c10::Stream exchange_stream(c10::Stream s);

void submit(c10::Stream s, std::function<void()> task);
bool query_stream(c10::Stream s);
void synchronize_stream(c10::Stream s);
void synchronize_device(c10::DeviceIndex device);
// Waits for pending tasks of the current stream, so an op issued under
// `with torch.tpu.stream(s)` runs after the work already queued on s.
void wait_current_stream(c10::DeviceIndex device);

// Events: opaque handles owned by torch.Event through the guard.
void* record_event(void* event, c10::Stream s);
void block_on_event(void* event, c10::Stream s);
bool query_event(void* event);
void synchronize_event(void* event);
double elapsed_ms(void* start, void* end);
void destroy_event(void* event);

} // namespace torch_tpu

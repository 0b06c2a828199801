// What an NVRTC translation unit declares for itself: NVRTC gets no include path here, so no
// system header provides these.
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

// A stand-in for libcuda.so, for test_bounded_wait_cuda_callback.py: just enough of the
// driver API for kvferry's checks at load time and for bounded_wait's host-function path
// (cuStreamWaitEvent + cuLaunchHostFunc), so kvferry's bookkeeping around them (stream
// pool, busy limit, context push/pop, fallbacks) runs on a machine without a GPU. It
// checks kvferry, not CUDA: the real driver is exercised by scripts/gpu-check.sh.
// Events are `fev` structs made with fake_event_new() and completed with
// fake_event_set(); a launched host function runs on its own thread once the event its
// stream waits on is complete. Calls that need a current context fail (201) without one.
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>
typedef struct { atomic_int done; } fev;
typedef struct { fev *wait; } fstream;
static atomic_int streams_created, launches, fired;
static __thread int depth;
int cuInit(unsigned f){return 0;}
int cuDeviceGetCount(int*n){*n=1;return 0;}
int cuDeviceGet(int*d,int o){*d=o;return 0;}
int cuDeviceGetName(char*n,int l,int d){n[0]=0;return 0;}
int cuDevicePrimaryCtxRetain(void**c,int d){*c=(void*)(0x1000L+d);return 0;}
int cuDevicePrimaryCtxRelease_v2(int d){return 0;}
int cuCtxSetCurrent(void*c){return 0;}
int cuCtxPushCurrent_v2(void*c){depth++;return 0;}
int cuCtxPopCurrent_v2(void**c){depth--;if(c)*c=0;return 0;}
#define STUB(n) int n(){return 1;}
STUB(cuMemAlloc_v2) STUB(cuMemFree_v2) STUB(cuMemHostAlloc) STUB(cuMemFreeHost)
STUB(cuMemcpyDtoHAsync_v2) STUB(cuMemcpyHtoDAsync_v2) STUB(cuMemcpyDtoH_v2) STUB(cuMemcpyHtoD_v2)
STUB(cuStreamDestroy_v2) STUB(cuStreamSynchronize) STUB(cuEventCreate) STUB(cuEventRecord)
STUB(cuEventDestroy_v2) STUB(cuPointerGetAttribute) STUB(cuMemGetAddressRange_v2)
int cuStreamCreate(void**s,unsigned f){if(depth<=0)return 201;*s=calloc(1,sizeof(fstream));streams_created++;return 0;}
int cuStreamWaitEvent(void*s,void*e,unsigned f){if(depth<=0)return 201;((fstream*)s)->wait=e;return 0;}
int cuEventQuery(void*e){return atomic_load(&((fev*)e)->done)?0:600;}
typedef void (*hostfn)(void*);
struct job{fev*e;hostfn fn;void*d;};
static void*run(void*a){struct job*j=a;while(!atomic_load(&j->e->done))usleep(50);j->fn(j->d);fired++;free(j);return 0;}
int cuLaunchHostFunc(void*s,hostfn fn,void*d){if(depth<=0)return 201;struct job*j=malloc(sizeof*j);j->e=((fstream*)s)->wait;j->fn=fn;j->d=d;launches++;pthread_t t;pthread_create(&t,0,run,j);pthread_detach(t);return 0;}
// helpers for the check
void*fake_event_new(){return calloc(1,sizeof(fev));}
void fake_event_set(void*e){atomic_store(&((fev*)e)->done,1);}
int fake_streams_created(){return streams_created;}
int fake_launches(){return launches;}
int fake_fired(){return fired;}
int fake_depth(){return depth;}

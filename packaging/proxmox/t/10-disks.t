#!/usr/bin/perl
# VM disks as Proxmox drives them, against a real `fewerbytes serve`: the storage
# activated, disks allocated (names and sizes as `qm set`/the GUI ask), listed, sized,
# resized, opened by QEMU at the path the plugin gives, written by `qm disk import`'s
# qemu-img convert, trimmed, and freed.

use strict;
use warnings;

use File::Temp qw(tempdir);
use Test::MockModule;
use Test::More;

use FewerbytesTest;
use PVE::Storage;
use PVE::Storage::Custom::FewerbytesPlugin;

my $plugin = 'PVE::Storage::Custom::FewerbytesPlugin';
my $MIB = 1024 * 1024;

# Every command the plugin runs, to check at the end that none opens the pool itself.
my @commands;
my $recorder = Test::MockModule->new($plugin);
my $run_command = \&PVE::Storage::Custom::FewerbytesPlugin::run_command;
$recorder->redefine(run_command => sub {
    push @commands, $_[0];
    return $run_command->(@_);
});

# The storage before its server runs: Proxmox shows it inactive, operations say why.
my $scfg = start_server(no_serve => 1);
eval { $plugin->activate_storage(STOREID, $scfg, {}) };
like($@, qr/storage 'fb' is not available: no fewerbytes server answers for pool .*vms\.pool/,
    'activate_storage without a server fails, naming the pool');
{
    my @warnings;
    local $SIG{__WARN__} = sub { push @warnings, @_ };
    is_deeply([$plugin->status(STOREID, $scfg, {})], [0, 0, 0, 0],
        'status without a server: inactive, nothing reported');
    like($warnings[0] // '', qr/^storage 'fb': no fewerbytes server answers/,
        'and a warning for the log says why');
}
FewerbytesTest::serve();
ok($plugin->activate_storage(STOREID, $scfg, {}), 'activate_storage once the server answers');

# alloc_image: Proxmox passes sizes in KiB; names are found or given.
is($plugin->alloc_image(STOREID, $scfg, 100, 'raw', undef, 32 * 1024), 'vm-100-disk-0',
    'the first disk of VM 100');
is($plugin->alloc_image(STOREID, $scfg, 100, 'raw', undef, 1001), 'vm-100-disk-1',
    'the next number');
is($plugin->alloc_image(STOREID, $scfg, 100, 'raw', 'vm-100-cloudinit', 4096),
    'vm-100-cloudinit', 'a name Proxmox chooses (cloud-init drive)');
is($plugin->alloc_image(STOREID, $scfg, 101, 'raw', undef, 64 * 1024), 'vm-101-disk-0',
    'numbers count per VM');
my %size = map { $_->{name} => $_->{size_bytes} } cli_json('volume', 'list')->@*;
is($size{'vm-100-disk-0'}, 32 * $MIB, '32768 KiB make a 32 MiB volume');
is($size{'vm-100-disk-1'}, 1001 * 1024 + 3072, '1001 KiB round up to whole 4 KiB blocks');
is($size{'vm-100-cloudinit'}, 4 * $MIB, 'the cloud-init drive is 4 MiB');

eval { $plugin->alloc_image(STOREID, $scfg, 100, 'qcow2', undef, 1024) };
like($@, qr/raw disk images only, not 'qcow2'/, 'qcow2 is refused');
eval { $plugin->alloc_image(STOREID, $scfg, 100, 'subvol', undef, 0) };
like($@, qr/containers are not supported/, 'a container volume is refused');
eval { $plugin->alloc_image(STOREID, $scfg, 100, 'raw', 'vm-101-disk-7', 1024) };
like($@, qr/illegal name 'vm-101-disk-7' - should be 'vm-100-\*'/, 'a name of another VM');
eval { $plugin->alloc_image(STOREID, $scfg, 100, 'raw', 'vm-100-disk-0', 1024) };
like($@, qr/vm-100-disk-0/, 'an existing name is refused by the pool, naming it');
eval { $plugin->alloc_image(STOREID, $scfg, 100, 'raw', 'vm-100-disk-9', 64 * 1024 * 1024) };
like($@, qr/would reserve 64\.00 GiB .* free for reservations/, 'past what the pool can reserve: numbers');

# list_images, as `pvesm list` and the GUI's content view show it.
my $all = $plugin->list_images(STOREID, $scfg);
is_deeply([map { $_->{volid} } @$all],
    [qw(fb:vm-100-cloudinit fb:vm-100-disk-0 fb:vm-100-disk-1 fb:vm-101-disk-0)],
    'every disk, by volume ID');
my ($disk0) = grep { $_->{volid} eq 'fb:vm-100-disk-0' } @$all;
is_deeply($disk0, { volid => 'fb:vm-100-disk-0', format => 'raw', size => 32 * $MIB,
        used => 0, vmid => 100 }, 'a disk: format, size, used, owner');
is_deeply([map { $_->{volid} } $plugin->list_images(STOREID, $scfg, 101)->@*],
    ['fb:vm-101-disk-0'], 'the disks of one VM');
is_deeply([map { $_->{volid} } $plugin->list_images(STOREID, $scfg, undef,
    ['fb:vm-101-disk-0', 'fb:vm-100-disk-1'])->@*],
    ['fb:vm-100-disk-1', 'fb:vm-101-disk-0'], 'the disks of a volume list');
cli('volume', 'create', 'by-hand', '--size', '4M');
ok(!grep({ $_->{volid} =~ /by-hand/ } $plugin->list_images(STOREID, $scfg)->@*),
    'a volume made by hand is not shown as a VM disk');

is(scalar($plugin->volume_size_info($scfg, STOREID, 'vm-100-disk-0')), 32 * $MIB,
    'volume_size_info: the size');

# path: the URI pve-storage turns into an nbd blockdev; QEMU opens it.
my $path = $plugin->path($scfg, 'vm-100-disk-0', STOREID);
is($path, "nbd+unix:///vm-100-disk-0?socket=$scfg->{'fewerbytes-socket'}", 'path is the NBD URI');
like(run_ok('qemu-img', 'info', '--output=json', $path), qr/"virtual-size": 33554432/,
    'qemu-img info opens the path and sees 32 MiB');

# `qm disk import` runs qemu-img convert -n ... -O raw SRC PATH into an allocated disk.
my $dir = tempdir(CLEANUP => 1);
run_ok('qemu-img', 'create', '-q', '-f', 'qcow2', "$dir/src.qcow2", '32M');
run_ok('qemu-io', '-f', 'qcow2', '-c', 'write -P 0xab 0 8M', '-c', 'write -P 0xcd 16M 4M',
    "$dir/src.qcow2");
run_ok('qemu-img', 'convert', '-p', '-n', '-f', 'qcow2', '-O', 'raw', "$dir/src.qcow2", $path);
like(run_ok('qemu-img', 'compare', '-f', 'qcow2', '-F', 'raw', "$dir/src.qcow2", $path),
    qr/Images are identical/, 'the imported disk reads back as the qcow2 image');
my (undef, $format, $used) = $plugin->volume_size_info($scfg, STOREID, 'vm-100-disk-0');
is($format, 'raw', 'volume_size_info: raw');
is($used, 12 * $MIB, 'volume_size_info: the 12 MiB written are used');
my $stats = cli_json('stats');
cmp_ok($stats->{stored_bytes}, '<=', 2 * $MIB,
    'the pool stores 12 MiB of two repeated bytes in at most 2 MiB');

# status, as the GUI's storage summary shows it: the pool's Size, and what a new disk
# (thick, as the plugin makes them) can still reserve.
my ($total, $avail, $used_bytes, $active) = $plugin->status(STOREID, $scfg, {});
$stats = cli_json('stats');
is($active, 1, 'status: active');
is($total, $stats->{size_bytes}, 'status: total is the pool\'s Size');
is($avail, $stats->{reservable_bytes}, 'status: avail is what a new disk can reserve');
is($used_bytes, $total - $avail, 'status: used is the rest');
cmp_ok($avail, '<=', $stats->{available_bytes}, 'status: avail is no more than stats\' Available');

# Discard from the guest (QEMU sends NBD trim) frees the blocks.
run_ok('qemu-io', '-f', 'raw', '-c', 'discard 0 8M', $path);
is(($plugin->volume_size_info($scfg, STOREID, 'vm-100-disk-0'))[2], 4 * $MIB,
    'a discard of 8 MiB leaves 4 MiB used');
unlike(run_ok('qemu-io', '-f', 'raw', '-c', 'read -P 0 0 8M', $path),
    qr/(verification failed|failed:)/, 'and the discarded range reads as zeros');

# volume_resize: Proxmox passes bytes; refused while the VM runs.
eval { $plugin->volume_resize($scfg, STOREID, 'vm-100-disk-0', 64 * $MIB, 1) };
like($@, qr/while its VM runs: QEMU cannot resize an NBD disk live; shut the VM down/,
    'live resize is refused, saying what to do');
$plugin->volume_resize($scfg, STOREID, 'vm-100-disk-0', 64 * $MIB + 1024, 0);
is(scalar($plugin->volume_size_info($scfg, STOREID, 'vm-100-disk-0')), 64 * $MIB + 4096,
    'a stopped VM\'s disk grows (to whole blocks)');
unlike(run_ok('qemu-io', '-f', 'raw', '-c', 'read -P 0xcd 16M 4M', '-c', 'read -P 0 32M 32M',
        $path), qr/(verification failed|failed:)/,
    'the data before the old end is kept, and the new end reads as zeros');

# free_image, as `qm destroy` or "Remove" do; refused while a client has the disk open.
my $reader = open(my $hold, '-|', 'qemu-io', '-f', 'raw', '-c', 'sleep 3000', $path) // die;
sleep(1);
eval { PVE::Storage::vdisk_free($plugin, STOREID, $scfg, 'fb:vm-100-disk-0') };
like($@, qr/vm-100-disk-0.*(connected|open|in use)/i, 'a disk a VM has open is not freed');
close($hold);
PVE::Storage::vdisk_free($plugin, STOREID, $scfg, 'fb:vm-100-disk-0');
ok(!grep({ $_->{volid} eq 'fb:vm-100-disk-0' } $plugin->list_images(STOREID, $scfg)->@*),
    'freed: gone from the list');
is($plugin->alloc_image(STOREID, $scfg, 100, 'raw', undef, 1024), 'vm-100-disk-0',
    'and its number is free again');

# rename_volume, as `qm disk move --target-vmid` (reassign) does.
is($plugin->rename_volume($scfg, STOREID, 'vm-101-disk-0', 102, undef), 'fb:vm-102-disk-0',
    'a disk reassigned to VM 102');
is_deeply([map { $_->{volid} } $plugin->list_images(STOREID, $scfg, 102)->@*],
    ['fb:vm-102-disk-0'], 'VM 102 has it');

# activate_volume checks that the disk exists; map_volume refuses (no block device).
ok($plugin->activate_volume(STOREID, $scfg, 'vm-100-disk-1'), 'activate_volume of a disk');
eval { $plugin->activate_volume(STOREID, $scfg, 'vm-100-disk-7') };
like($@, qr/volume 'fb:vm-100-disk-7' is not available: no volume named 'vm-100-disk-7'/,
    'activate_volume of a missing disk names it');
eval { $plugin->map_volume(STOREID, $scfg, 'vm-100-disk-1') };
like($@, qr/cannot be mapped to a block device/, 'map_volume refuses, saying why');

cmp_ok(scalar(@commands), '>', 20, 'the plugin ran the fewerbytes command');
is_deeply([grep { !grep({ $_ eq '--require-server' } @$_) } @commands], [],
    'every command went through the server (--require-server), never opening the pool');
is_deeply([grep { !grep({ $_ eq $scfg->{'fewerbytes-control-socket'} } @$_) } @commands], [],
    'every command named the storage\'s control socket');

stop_server();
done_testing();
